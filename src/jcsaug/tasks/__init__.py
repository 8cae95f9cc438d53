"""The paper's dataset tasks: raw layouts, split rules, ``jcsaug prepare`` and the bundles' per-task settings."""

from __future__ import annotations

from jcsaug.tasks.prepare import DATALIST_NAME, prepare_case, prepare_task
from jcsaug.tasks.registry import TASKS, get_task, list_tasks, register_task
from jcsaug.tasks.settings import bundle_task, load_split, paper_setting
from jcsaug.tasks.spec import PrepareError, RawCase, TaskSpec

__all__ = [
    "DATALIST_NAME",
    "PrepareError",
    "RawCase",
    "TASKS",
    "TaskSpec",
    "bundle_task",
    "get_task",
    "list_tasks",
    "load_split",
    "paper_setting",
    "prepare_case",
    "prepare_task",
    "register_task",
]
