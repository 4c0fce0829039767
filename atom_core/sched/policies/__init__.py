"""The built-in scheduling policies, each in a file named after it; registered in `default_plugins`."""
