"""``python -m meshplan`` (also ``torchrun ... -m meshplan run SCHEDULE.json``)."""

from meshplan.cli.app import main

main()
