"""Tasks a recipe can name. Importing this package registers the built-in tasks."""

from flash.tasks import (
    Task,
    TaskItem,
    make_task,
    register_task,
    registered_tasks,
    task_class,
    task_options,
)
from . import calculator, chainsum, echo, pyfunc, rgym, stutter, wordproblems  # noqa: F401  (registers the built-in tasks)
from flash.envs import task as _env_tasks  # noqa: F401,E402  (registers corridor, frozenlake)
from flash.data import task as _data_task  # noqa: F401,E402  (registers dataset)
from flash.envs import verifiers_env as _verifiers  # noqa: F401,E402  (registers verifiers)

__all__ = ["Task", "TaskItem", "make_task", "register_task", "registered_tasks", "task_class", "task_options"]
