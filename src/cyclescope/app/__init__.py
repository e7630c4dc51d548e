"""The application layer: what the front ends (the command line today; the web UI and the fleet
engine next) do with a profile, as typed functions that return plain data. A Profile is a
selection of the database opened for analysis; the functions here resolve procedures, build
listings, run calc and gather values over it. They print nothing: warnings go to the Profile's
``warn``, failures are CycleScopeErrors with one-line messages, and the front end renders."""
