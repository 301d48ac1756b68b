"""Tasks a recipe can name. Importing this package registers the built-in tasks."""

from recipes.tasks.base import (
    Task,
    TaskItem,
    make_task,
    register_task,
    registered_tasks,
    task_options,
)
from recipes.tasks import chainsum, echo, stutter  # noqa: F401  (registers the built-in tasks)

__all__ = ["Task", "TaskItem", "make_task", "register_task", "registered_tasks", "task_options"]
