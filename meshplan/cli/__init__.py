"""The command line (typer + rich): each command parses its flags, builds a request, calls one library function and
prints. :mod:`app` (the typer app and ``search``), :mod:`options` (shared flags), one module per other command:
:mod:`simulate` (simulate, validate, schema), :mod:`job` (``--tp/--dp``), :mod:`run` (run, compare),
:mod:`calibrate`, :mod:`reproduce`, :mod:`plot`, :mod:`topo`, :mod:`sensitivity` (search's ``--sensitivity``).
"""
