"""The file formats: schedule JSON (format, io, to_arrays) and the Measurement JSON."""
