"""tokenmill.choose: the cheapest candidate (model, engine, request settings) whose quality on a sample
of the user's own job clears a bar. Each candidate runs the sample as a real `tokenmill run` job;
its answers are scored against the expected ones; the report puts quality beside $/M and the
projected cost of the whole job."""
