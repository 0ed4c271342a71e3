"""The watch over running ranks: heartbeats and the naming of a stalled rank (``heartbeat``), each rank's
pace and the slow-rank warning (``pace``), replica checksums (``replicas``) and the status file that
``ddpkit status`` reads (``status``). Imports only the core."""
