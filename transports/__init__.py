"""Host side: worlds (who the ranks are), symmetric windows (where memory lives), GIN
(how bytes and signals move), errors and the job launcher (commref.transports)."""
