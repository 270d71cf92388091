"""The runtime: the Communicator and its work queue, argument validation, topology
detection and torch.distributed bring-up."""
