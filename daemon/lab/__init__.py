"""`peerd lab`: hosts as Linux network namespaces on one machine, real daemons in them, shaped links
and a schedule of faults (docs/lab.md)."""
