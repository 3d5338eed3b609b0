"""Mesh-Attention: the algorithm, its tile grid, in-tile fetch order, schedule builder and closed-form timing."""
