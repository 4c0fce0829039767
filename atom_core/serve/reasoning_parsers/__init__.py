"""The reasoning parsers Atom ships, one file per format (registered in `atom_core.plugins.builtin`)."""
