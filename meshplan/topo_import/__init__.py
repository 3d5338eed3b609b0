"""``meshplan topo import``: :mod:`dumps` (reading ``nvidia-smi topo -m`` and NCCL's topology XML),
:mod:`layout` (mapping a node's dumps onto the topology format), :mod:`yaml_text` (the YAML with a comment per
number), :mod:`importer` (the command's work).
"""
