"""The catalog: backends, runtimes, markers, cases, fixes, gate policies and waivers."""
