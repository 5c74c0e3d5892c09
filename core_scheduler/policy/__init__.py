"""Pure policies over snapshots: no I/O, no clock reads."""
