"""tokenmill.split: any tokenmill input cut into OpenAI Batch API input files within the API's
limits, for users who upload the files by hand (`tokenmill run --batch-api` does the same cut
and submits the parts itself)."""
