"""Training a draft model for a target on an ordinary CPU (`edgespec distill`); needs the export extra."""
