"""Trace: the model into an fx graph for analysis (`tracing`: torch.fx, else torch.export), and
fake copies of tensors and of a model's state for models that do not fit (`fake`)."""
