"""CP-SAT stream orders (model), their greedy hint, and the order they produce."""
