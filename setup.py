"""The one thing pyproject.toml cannot say: the JSON text's compiled loops (``meshplan/plan/json/_text.c``: the
reader's number scan, the writer's stores; :mod:`meshplan.plan.json.compiled`). ``optional=True``: where they do not
build (no C compiler), the install goes on without them and numpy does the same work — the same results, slower."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("meshplan.plan.json._text", ["meshplan/plan/json/_text.c"], optional=True)])
