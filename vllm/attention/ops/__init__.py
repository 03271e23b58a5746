"""Plain-torch reference ops. Each defines the semantics that a fast kernel must reproduce."""
