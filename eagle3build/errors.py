"""Errors a user can fix: the message names the file, line or config key and what to do."""


class UserError(Exception):
    """A problem with the user's input or configuration, reported without a traceback."""


class ConfigError(UserError):
    """A config value is wrong; the message names the key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"config key '{key}': {message}")
        self.key = key
