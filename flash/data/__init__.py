"""Datasets: local files read through Hugging Face ``datasets`` (``files``), rows made into task
items (``rows``), and the ``dataset`` task over them (``task``)."""
