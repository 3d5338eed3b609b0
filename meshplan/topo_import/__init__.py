"""Importing a machine's topology (nvidia-smi / lstopo / ibstat dumps) into a topology YAML."""
