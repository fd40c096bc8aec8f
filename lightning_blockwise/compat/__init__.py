"""What the package knows about the outside libraries it depends on deeply, one module per library."""
