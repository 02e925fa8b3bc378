"""The notebooks' helpers, one module per concern; each notebook imports the ones it uses.

- runs: the repository's scripts run for real (commands, logs followed as written, bounded waits, Processes)
- diffs: the diff between two numbered scripts, hunk by hunk, read from the repository when the notebook runs
- diagrams: flows and sequence diagrams
- ddp_concepts: 01's experiments in a real 2-process gloo group
- ddp_machinery: ddp_under_the_hood's experiments on DDP's machinery
- diagnosis: when_it_breaks's broken runs and the tools that diagnose them
"""
