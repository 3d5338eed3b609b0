"""What the lower layers computed, for people: :mod:`tables` (the CLI's rich tables), :mod:`plot_data` and
:mod:`plot` (figures: the data without matplotlib, then the drawing), :mod:`trace` (Chrome/Perfetto traces).
"""
