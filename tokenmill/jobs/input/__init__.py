"""Reading a job's input: formats, parsing and checking each line, and cutting a subset of it.

What other packages use of it is exported here; the modules behind it are the input layer's own.
"""

from tokenmill.jobs.input.reader import FORMATS, CsvLayout, InputFile, input_identity, json_object_line, read_input
from tokenmill.jobs.input.request import BatchRequest, DocumentOptions, Entry, LineError
from tokenmill.jobs.input.subset import write_subset

__all__ = ["FORMATS", "BatchRequest", "CsvLayout", "DocumentOptions", "Entry", "InputFile", "LineError",
           "input_identity", "json_object_line", "read_input", "write_subset"]
