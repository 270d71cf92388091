"""The vocabulary every layer shares: collective names, element types and operators,
errors, and the topology (where ranks live). Imports nothing else from pccl."""
