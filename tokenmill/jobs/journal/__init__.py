"""The job's journal: OpenAI batch output rows, appended one `write` at a time, and how a re-run
finds what is already done without reading them.

Exactly once rests on four things:
- a row is written with a single `os.write` of the whole line (newline included) on an
  O_APPEND descriptor, so a killed process leaves whole lines, and at worst (power loss, a full
  disk) one torn line at the end, which the next start cuts off;
- before each result row, its record goes to the done-index beside the results (`results.index`:
  the row's input line, its custom_id's key, a few flags, and the results file's length once the
  row is in). A re-run reads the index, not the rows: a record whose row is not in the results
  file (killed between the two writes) is dropped, and so are bytes past the last record;
- a re-run skips every line with a result or a *final* error, and retries the rest;
- `job.json` holds the input's identity and the options that change results, and a re-run with
  a different input or options refuses instead of mixing two jobs in one file.

These files are the job's journal, always on local disk. Where the results are also wanted as
parts (an object store output, or parquet), parts.py seals the journal's rows into committed
parts as the job goes (`Sealer`), and a resume counts those parts' index records instead.
"""

from tokenmill.jobs.journal.guard import Footprint, OutputLock, refuse_inputs_in, with_temporaries
from tokenmill.jobs.journal.paths import OutputPaths
from tokenmill.jobs.journal.writers import JsonlAppender

__all__ = ["Footprint", "JsonlAppender", "OutputLock", "OutputPaths", "refuse_inputs_in",
           "with_temporaries"]
