"""Finding the binary behind an image (its recorded path, the database's archive, the debug
directory), its symbols and its code: above both images (which parse files) and db (which keeps
archived copies and stored symbol tables)."""
