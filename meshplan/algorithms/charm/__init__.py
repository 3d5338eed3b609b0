"""CHARM+ (merge, RM+, full CHARM+): the algorithm, its swap lists and its schedule builder."""
