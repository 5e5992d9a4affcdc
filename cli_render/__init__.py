"""What the ``pipeplan`` commands print: rich tables, progress and notes, one module per command.

``cli.py`` parses options and calls the library; the library returns values; these modules turn the
values into text. They are the only modules that use rich.
"""
