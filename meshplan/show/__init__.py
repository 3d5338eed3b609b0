"""Tables, plots and traces of what the lower layers computed."""
