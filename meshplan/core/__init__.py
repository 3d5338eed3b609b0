"""The bottom layer: units, errors, atomic file writes, CSR arrays. Imports nothing of meshplan."""
