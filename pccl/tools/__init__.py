"""Command-line tools: pccl-bench, pccl-kernel-bench and pccl-sim, and the helpers they share
(cli). Tools import the library; nothing in the library imports a tool."""
