"""The one exception type the planner raises for bad input."""


class PlanError(ValueError):
    """Bad planner input. The message starts with the offending field name, e.g. ``tp: ...``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
