"""The `disagg` command line (main: one subcommand per role and operator command) and the operator commands: up
(this machine's roles, supervised), status, doctor/ (one machine's preflight), config_check, models and checkpoints
(`disagg models prepare`). The top of the import graph: may import every other backends package and kv_bridge's
root; what a role needs is imported inside its subcommand, so `disagg --help` loads no engine."""
