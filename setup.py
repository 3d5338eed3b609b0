"""The one thing pyproject.toml cannot say: the optional compiled number scan of the schedule reader
(``meshplan/plan/json/_scan.c``, :mod:`meshplan.plan.json.skeleton`). ``optional=True``: where it does not build (no
C compiler), the install goes on without it and the reader scans with numpy — the same results, slower."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("meshplan.plan.json._scan", ["meshplan/plan/json/_scan.c"], optional=True)])
