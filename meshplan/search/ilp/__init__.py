"""CP-SAT stream orders (``search --scheduler ilp|auto``): :mod:`model` (the schedule as a job shop with shared
links, and its proven bound), :mod:`hint` (the greedy order by list scheduling: the model's hint and baseline),
:mod:`order` (a solution written back into a schedule).
"""
