"""The running job: process groups, hang detection, the event log, topology, measurements."""
