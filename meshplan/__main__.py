"""``python -m meshplan`` (also ``torchrun ... -m meshplan run SCHEDULE.json``)."""

from meshplan.cli import main

main()
