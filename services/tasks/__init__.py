"""Task registry: name -> Task class."""

from services.errors import load_object
from services.tasks.base import Task
from services.tasks.dataset import DatasetTask
from services.tasks.environment import AgentTask, EnvironmentTask
from services.tasks.randomwalks import RandomWalksTask
from services.tasks.sentiment import SentimentTask

TASKS: dict[str, type[Task]] = {"randomwalks": RandomWalksTask, "smollm2-sentiment": SentimentTask,
                                "dataset": DatasetTask, "environment": EnvironmentTask, "agent": AgentTask}


def get_task(name: str, **options) -> Task:
    """A built-in task by name, or your own as ``package.module:ClassName`` (a Task subclass)."""
    if ":" in name:
        cls = load_object(name, "task.name", "package.module:ClassName")
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise ValueError(f"task {name!r} is not a services.tasks.Task subclass")
        return cls(**options)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}, or give module:Class")
    return TASKS[name](**options)


__all__ = ["TASKS", "Task", "get_task"]
