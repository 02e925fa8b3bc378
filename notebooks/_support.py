"""Temporary: the notebooks' helpers now live in notebooks/lessons/, one module per concern. This shim keeps a
lesson still importing `_support` working until it is moved over; nothing else may be added here."""
from lessons.ddp_machinery import *  # noqa: F403
from lessons.runs import *  # noqa: F403
from lessons.runs import free_port, kill_tree, load_script, run_group  # noqa: F401
