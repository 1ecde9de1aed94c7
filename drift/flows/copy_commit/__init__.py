"""The copy_commit flow kind."""
