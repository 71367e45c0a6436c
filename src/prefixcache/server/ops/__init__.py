"""The operators' routes and their state: cache stats, pins and flushes, the exactness audit, the
live dashboard, metrics, snapshots, the busting watch, the trace log and miss reasons."""
