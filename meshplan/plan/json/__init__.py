"""The file formats of the contract: the schedule JSON (:mod:`format`: pydantic models; :mod:`io`: read and
write, ``.json`` or ``.json.gz``; :mod:`to_arrays`: a document as the Schedule's arrays) and the Measurement JSON
(:mod:`measurement`) that ``meshplan run`` writes.
"""
