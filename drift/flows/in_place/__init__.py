"""The in_place flow kind."""
