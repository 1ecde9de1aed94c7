"""The kernel_commit flow kind."""
