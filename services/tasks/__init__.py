"""Task registry: name -> Task class."""

from services.tasks.base import Task
from services.tasks.randomwalks import RandomWalksTask

TASKS: dict[str, type[Task]] = {"randomwalks": RandomWalksTask}


def get_task(name: str, **options) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    return TASKS[name](**options)


__all__ = ["TASKS", "Task", "get_task"]
