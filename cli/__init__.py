"""The admin CLI, ``kvtier``: a client of a running daemon, plus offline tools."""
