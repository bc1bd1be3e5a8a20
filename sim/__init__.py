"""``kvtier.sim``: the tier stack simulated on traces, offline.

- ``kvtier.sim.trace``: reading and writing traces in the Mooncake format, and which blocks
  a cache can store (a request's partial last block cannot be).
- ``kvtier.sim.tracegen``: synthetic traces (``kvtier trace gen``).
- ``kvtier.sim.engine``: the replay of a trace through the daemon's tier stack semantics
  (inclusive L1/L2, write policies, protection, queue hints) and its policies, on the
  trace's clock (``kvtier replay``).
- ``kvtier.sim.report``: sweeps, tables and plots.
- ``kvtier.sim.cli``: the two commands, registered on the ``kvtier`` CLI.

The simulator runs the daemon's policy objects unchanged (``kvtier.daemon.policy``); nothing
in the daemon imports it.
"""

# The two commands' lines in ``kvtier --help``: the CLI registers the commands themselves
# (``kvtier.sim.cli``, whose imports took ~0.1 s of every ``kvtier`` run) only to run one.
COMMAND_HELP = {
    "replay": "replay a Mooncake-format trace through the tier stack and its policies (offline)",
    "trace": "synthetic traces (offline)",
}
