"""Host-device synchronisation: the torch-only detector, the scan of an update over a pool,
and the cost model."""
