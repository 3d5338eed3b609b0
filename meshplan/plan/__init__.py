"""The IR and the JSON contract: Plan, Schedule, the builder, dataflow, hazards, the verifier; json/ holds the file formats."""
