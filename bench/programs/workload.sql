-- A training and measuring run for the sqlite3 shell in bench/optimize.py (run as
-- `sqlite3 :memory: ".read workload.sql"`): inserts, an index build, joins, aggregates, sorting,
-- string functions and pattern matching, in memory (so the run measures the engine, not the disk).
CREATE TABLE customer(id INTEGER PRIMARY KEY, name TEXT, region INTEGER, joined INTEGER);
CREATE TABLE orders(id INTEGER PRIMARY KEY, customer INTEGER, amount REAL, day INTEGER, note TEXT);

WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20000)
INSERT INTO customer SELECT i, 'customer-' || hex(i * 2654435761 % 65536), i % 17, (i * 7919) % 3650 FROM n;

WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 120000)
INSERT INTO orders SELECT i, (i * 48271) % 20000 + 1, ((i * 16807) % 100000) / 100.0, (i * 31) % 3650,
       CASE WHEN i % 11 = 0 THEN 'rush ' || i ELSE 'standard' END FROM n;

CREATE INDEX orders_customer ON orders(customer);
CREATE INDEX customer_region ON customer(region, joined);

SELECT c.region, count(*), round(sum(o.amount), 2), round(avg(o.amount), 2)
  FROM orders o JOIN customer c ON c.id = o.customer
 GROUP BY c.region ORDER BY 3 DESC LIMIT 5;

SELECT c.name, count(*) AS n, max(o.amount)
  FROM customer c JOIN orders o ON o.customer = c.id
 WHERE c.joined BETWEEN 100 AND 900
 GROUP BY c.id ORDER BY n DESC, c.name LIMIT 5;

SELECT count(*), sum(length(note)) FROM orders WHERE note LIKE 'rush%7';

SELECT day / 365 AS year, count(DISTINCT customer), round(sum(amount), 2)
  FROM orders GROUP BY year ORDER BY year;

SELECT name FROM customer WHERE substr(name, 10) IN (SELECT hex(customer % 4096) FROM orders WHERE amount > 990)
 ORDER BY name LIMIT 3;

UPDATE orders SET amount = amount * 1.1 WHERE day % 7 = 0;
DELETE FROM orders WHERE amount < 5;
SELECT count(*), round(sum(amount), 2) FROM orders;
