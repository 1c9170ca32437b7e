"""`tokenmill cascade`: the cheap tier answers every row, only the rows whose answer fails the
acceptance checks go on to the next (dearer) tier."""
